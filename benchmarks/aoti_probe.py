"""Why does loading an AOTInductor package crash on the lent H200? A 1-op model, no custom ops.

    python benchmarks/aoti_probe.py        # on the GPU machine; give it several minutes (compile ~1-2 min)

Builds a package, lists its files, runs `ldd` on its shared objects, then loads and runs it in fresh
processes with faulthandler on (once plainly, once with CUDA_MODULE_LOADING=EAGER) and prints each return
code and the end of each stderr. export/README.md ("AOTInductor on the H200") says what it has found so far.
"""
import glob, os, subprocess, sys, zipfile
import torch

class M(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 + 1

pkg = "/tmp/aoti_probe/m.pt2"
os.makedirs(os.path.dirname(pkg), exist_ok=True)
x = torch.randn(4, 8, device="cuda")
ep = torch.export.export(M().cuda(), (x,))
torch._inductor.aoti_compile_and_package(ep, package_path=pkg)
print("compiled", os.path.getsize(pkg), flush=True)
with zipfile.ZipFile(pkg) as z:
    names = z.namelist()
    print("package files:", [n for n in names if n.endswith((".so", ".cubin", ".json"))][:10])
    z.extractall("/tmp/aoti_probe/x")
for so in glob.glob("/tmp/aoti_probe/x/**/*.so", recursive=True):
    print("ldd", so, subprocess.run(["ldd", so], capture_output=True, text=True).stdout[-1500:])
code = ("import torch, faulthandler; faulthandler.enable(); "
        "m = torch._inductor.aoti_load_package('%s'); print('loaded', flush=True); "
        "print(m(torch.randn(4, 8, device='cuda')).sum().item())" % pkg)
for env_extra in ({}, {"CUDA_MODULE_LOADING": "EAGER"}):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env_extra})
    print("fresh process", env_extra, "rc", r.returncode, r.stdout[-500:], r.stderr[-2500:], flush=True)
