import ctypes, json, subprocess, sys, time, os
from mooncake_rs.store import MooncakeDistributedStore
MiB = 1 << 20
mode, seg_mib = sys.argv[1], int(sys.argv[2])
proc = subprocess.Popen(["./mooncake-master", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
addr = proc.stdout.readline().split()[-1]
t = time.perf_counter()
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", seg_mib * MiB, 16 * MiB, "shm", "", addr) == 0
setup_s = time.perf_counter() - t
size = MiB
if mode == "torch":
    import torch
    bufs = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    ptrs = [b.data_ptr() for b in bufs]
else:
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    ptrs = []
    for _ in range(2):
        p = ctypes.c_uint64(); assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)) == 0
        ptrs.append(p.value)
for p in ptrs:
    assert s.register_buffer(p, size) == 0
# a host put/get first: what the host path costs at first use
hb = (ctypes.c_ubyte * size)(); hp = ctypes.addressof(hb); assert s.register_buffer(hp, size) == 0
t = time.perf_counter(); assert s.put_from("h", hp, size) == 0; host_put = time.perf_counter() - t
calls = []
for i in range(6):
    t = time.perf_counter(); assert s.put_from(f"k{i}", ptrs[0], size) == 0; calls.append(round((time.perf_counter() - t) * 1e3, 2))
gets = []
for i in range(3):
    t = time.perf_counter(); assert s.get_into(f"k{i}", ptrs[1], size) == size; gets.append(round((time.perf_counter() - t) * 1e3, 2))
print(json.dumps({"mode": mode, "segment_mib": seg_mib, "setup_ms": round(setup_s * 1e3, 1), "host_put_ms": round(host_put * 1e3, 2), "device_put_ms": calls, "device_get_ms": gets}))
s.close(); proc.terminate()
