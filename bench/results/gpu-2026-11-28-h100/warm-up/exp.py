import ctypes, json, subprocess, sys, time, os
from mooncake_rs.store import MooncakeDistributedStore
MiB = 1 << 20
mode, sizes, iters = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
master_bin = os.environ.get("MASTER", "./mooncake-master")
proc = subprocess.Popen([master_bin, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
addr = proc.stdout.readline().split()[-1]
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", 6 * 4 * max(sizes) + 64 * MiB, 16 * MiB, "shm", "", addr) == 0
if mode == "torch":
    import torch
    bufs = [torch.randint(0, 256, (max(sizes),), dtype=torch.uint8, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    ptrs = [b.data_ptr() for b in bufs]
else:
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    if mode == "raw":
        assert cu.cuCtxSetCurrent(ctx) == 0
    else:
        assert cu.cuCtxSetCurrent(ctx) == 0
    ptrs = []
    for _ in range(2):
        p = ctypes.c_uint64(); assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(max(sizes))) == 0
        ptrs.append(p.value)
    if mode == "raw0":
        assert cu.cuCtxSetCurrent(ctypes.c_void_p(0)) == 0
for p in ptrs:
    assert s.register_buffer(p, max(sizes)) == 0, "register"
out = {"mode": mode}
for size in sizes:
    put, get, rm = [], [], []
    for i in range(iters):
        t = time.perf_counter(); r = s.put_from(f"k/{size}/{i}", ptrs[0], size); put.append(time.perf_counter() - t)
        assert r == 0, r
        t = time.perf_counter(); s.remove(f"k/{size}/{i}"); rm.append(time.perf_counter() - t)
    assert s.put_from("r", ptrs[0], size) == 0
    for i in range(iters):
        t = time.perf_counter(); r = s.get_into("r", ptrs[1], size); get.append(time.perf_counter() - t)
        assert r == size, r
    s.remove("r")
    us = lambda v: [round(x * 1e6, 1) for x in v]
    q = lambda v: {k: round(sorted(v)[int(len(v) * f)] * 1e6, 1) for k, f in (("p10", .1), ("p50", .5), ("p90", .9))}
    out[size] = {"put": q(put[10:]), "get": q(get[10:]), "remove": q(rm[10:]), "put_first": us(put[:25]), "get_first": us(get[:25])}
print(json.dumps(out))
s.close(); proc.terminate()
