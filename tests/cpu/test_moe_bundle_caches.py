"""tools/device/moe_bundle.sh save-caches: the kernels DeepSeek-V4's first engine compiled
(DeepGEMM, tilelang, Triton) come back in one archive that `install` unpacks on a fresh
machine, without DeepGEMM's half-built kernels."""

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "tools" / "device" / "moe_bundle.sh"


def test_save_caches_packs_finished_kernels_only(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    kernel = home / ".cache/vllm/deep_gemm/cache/kernel.sm90_gemm.abc/kernel.cubin"
    half_built = home / ".cache/vllm/deep_gemm/tmp/kernel.partial.cu"
    triton = home / ".triton/cache/xyz/kernel.cubin"
    for path in (kernel, half_built, triton):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"sm90")
    out.mkdir()
    done = subprocess.run(
        ["bash", str(SCRIPT), "save-caches"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "jit_caches.tar.gz") as archive:
        names = set(archive.getnames())
    assert str(kernel.relative_to(home)) in names
    assert str(triton.relative_to(home)) in names
    assert not any("deep_gemm/tmp" in name for name in names)
