"""tools/device/bundle.sh save-caches: what a GPU machine compiled (Triton's kernels,
torch.compile's per engine, DeepGEMM's and tilelang's) comes back in one archive that
`install` unpacks on a fresh machine, without DeepGEMM's half-built kernels."""

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "tools" / "device" / "bundle.sh"


def test_save_caches_packs_finished_kernels_only(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    kernel = home / ".cache/vllm/deep_gemm/cache/kernel.sm90_gemm.abc/kernel.cubin"
    half_built = home / ".cache/vllm/deep_gemm/tmp/kernel.partial.cu"
    triton = home / ".triton/cache/xyz/kernel.cubin"
    compiled = home / ".cache/vllm/torch_compile_cache/9618ca0bbb/rank_0_0/backbone/model"
    for path in (kernel, half_built, triton, compiled):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"sm90")
    out.mkdir()
    done = subprocess.run(
        ["bash", str(SCRIPT), "save-caches", "dsv4"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "dsv4_caches.tar.gz") as archive:
        names = set(archive.getnames())
    for path in (kernel, triton, compiled):
        assert str(path.relative_to(home)) in names
    assert not any("deep_gemm/tmp" in name for name in names)


def test_save_caches_needs_a_name(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPT), "save-caches"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and not list(tmp_path.glob("*.tar.gz"))
