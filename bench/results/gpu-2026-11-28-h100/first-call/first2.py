import ctypes, json, subprocess, sys, time
from mooncake_rs.store import MooncakeDistributedStore
MiB = 1 << 20
mode, seg_mib = sys.argv[1], int(sys.argv[2])
proc = subprocess.Popen(["./mooncake-master", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
addr = proc.stdout.readline().split()[-1]
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", seg_mib * MiB, 16 * MiB, "shm", "", addr) == 0
size = MiB
if mode == "torch":
    import torch
    bufs = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    torch.cuda.synchronize(); ptrs = [b.data_ptr() for b in bufs]
else:
    cu = ctypes.CDLL("libcuda.so.1"); assert cu.cuInit(0) == 0
    dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    ptrs = []
    for _ in range(2):
        p = ctypes.c_uint64(); assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)) == 0; ptrs.append(p.value)
for p in ptrs: assert s.register_buffer(p, size) == 0
t0 = time.perf_counter(); calls = []; i = 0
while True:
    t = time.perf_counter(); r = s.put_from(f"k{i}", ptrs[0], size); d = time.perf_counter() - t
    assert r == 0, r
    t2 = time.perf_counter(); g = s.get_into(f"k{i}", ptrs[1], size); dg = time.perf_counter() - t2
    assert g == size, g
    s.remove(f"k{i}")
    direct, staged = s._device_bytes()
    calls.append((round(t - t0, 3), round(d * 1e3, 2), round(dg * 1e3, 2), direct > 0))
    i += 1
    if (direct > 0 and i > 3 and calls[-3][3]) or time.perf_counter() - t0 > 40: break
    time.sleep(0.05)
first_direct = next((c[0] for c in calls if c[3]), None)
slow = max(c[1] for c in calls)
print(json.dumps({"mode": mode, "segment_mib": seg_mib, "calls": len(calls), "first_direct_at_s": first_direct, "slowest_put_ms": slow, "slowest_get_ms": max(c[2] for c in calls), "first": calls[:6], "last": calls[-3:]}))
s.close(); proc.terminate()
