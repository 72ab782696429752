"""tools/device/bundle.sh save-caches: what a GPU machine compiled (Triton's kernels,
torch.compile's per engine, DeepGEMM's and tilelang's) comes back as an archive in pieces
small enough to leave $OUT, without DeepGEMM's half-built kernels; restore-caches (run by
`install`) unpacks it on a fresh machine only once every piece is stashed."""

import io
import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "tools" / "device" / "bundle.sh"


def bundle(*args, home, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


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
    done = bundle("save-caches", "dsv4", home=home, OUT=str(out))
    assert done.returncode == 0, done.stderr
    pieces = sorted(out.glob("dsv4_caches.tar.gz.*"))
    assert pieces
    joined = b"".join(piece.read_bytes() for piece in pieces)
    with tarfile.open(fileobj=io.BytesIO(joined)) as archive:
        names = set(archive.getnames())
    for path in (kernel, triton, compiled):
        assert str(path.relative_to(home)) in names
    assert not any("deep_gemm/tmp" in name for name in names)


def test_save_caches_can_keep_only_the_named_caches(tmp_path):
    """DeepGEMM's and tilelang's kernels alone: an archive small enough to commit."""
    home, out = tmp_path / "home", tmp_path / "out"
    kernel = home / ".cache/vllm/deep_gemm/cache/kernel.sm90_gemm.abc/kernel.cubin"
    tilelang = home / ".tilelang/cache/mhc/kernel.so"
    triton = home / ".triton/cache/xyz/kernel.cubin"
    for path in (kernel, tilelang, triton):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"sm90")
    out.mkdir()
    done = bundle("save-caches", "dsv4", "deep_gemm", "tilelang", home=home, OUT=str(out))
    assert done.returncode == 0, done.stderr
    joined = b"".join(piece.read_bytes() for piece in sorted(out.glob("dsv4_caches.tar.gz.*")))
    with tarfile.open(fileobj=io.BytesIO(joined)) as archive:
        names = set(archive.getnames())
    assert {str(kernel.relative_to(home)), str(tilelang.relative_to(home))} <= names
    assert not any(name.startswith(".triton") for name in names)
    wrong = bundle("save-caches", "dsv4", "deepgemm", home=home, OUT=str(tmp_path))
    assert wrong.returncode != 0 and "deep_gemm" in wrong.stderr


def test_save_caches_needs_a_name(tmp_path):
    done = bundle("save-caches", home=tmp_path, OUT=str(tmp_path))
    assert done.returncode != 0 and not list(tmp_path.glob("*_caches*"))


def test_large_caches_come_back_in_pieces_under_the_file_limit(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    kernels = home / ".triton/cache/big/kernel.cubin"
    kernels.parent.mkdir(parents=True)
    kernels.write_bytes(os.urandom(40 << 20))  # incompressible, like compiled kernels
    out.mkdir()
    assert bundle("save-caches", "dense", home=home, OUT=str(out)).returncode == 0
    sizes = [piece.stat().st_size for piece in sorted(out.glob("dense_caches.tar.gz.*"))]
    assert len(sizes) == 3 and max(sizes) < 16 << 20


def test_restore_waits_for_every_piece_then_unpacks_once(tmp_path):
    built, out, stashed = tmp_path / "built", tmp_path / "out", tmp_path / "stashed"
    kernels = built / ".triton/cache/big/kernel.cubin"
    kernels.parent.mkdir(parents=True)
    kernels.write_bytes(os.urandom(20 << 20))
    out.mkdir()
    assert bundle("save-caches", "probe", home=built, OUT=str(out)).returncode == 0
    first, *rest = sorted(out.glob("probe_caches.tar.gz.*"))
    fresh = tmp_path / "fresh"
    fresh.mkdir()

    def stash_and_restore(piece):
        assert bundle("stash", str(piece.parent), home=fresh, VB_PARTS=str(stashed)).returncode == 0
        return bundle("restore-caches", home=fresh, VB_PARTS=str(stashed))

    (out / "a").mkdir()
    first.rename(out / "a" / first.name)
    partial = stash_and_restore(out / "a" / first.name)
    assert "not whole yet" in partial.stderr
    assert not (fresh / ".triton/cache/big").exists()

    (out / "b").mkdir()
    for piece in rest:
        piece.rename(out / "b" / piece.name)
    whole = stash_and_restore(out / "b" / rest[0].name)
    assert "restored probe_caches.tar.gz" in whole.stdout
    assert (fresh / ".triton/cache/big/kernel.cubin").read_bytes() == kernels.read_bytes()

    again = bundle("restore-caches", home=fresh, VB_PARTS=str(stashed))
    assert again.returncode == 0 and "restored" not in again.stdout


def test_a_committed_archive_restores_without_stashing(tmp_path):
    """Only committed files outlive a checkout: tools/device/caches/ travels with the tree
    and restores on install like a stashed archive."""
    committed = sorted((SCRIPT.parent / "caches").glob("*_caches.tar.gz*"))
    assert committed
    fresh, stashed = tmp_path / "fresh", tmp_path / "stashed"
    fresh.mkdir()
    done = bundle("restore-caches", home=fresh, VB_PARTS=str(stashed))
    assert done.returncode == 0, done.stderr
    assert "restored" in done.stdout and any(fresh.iterdir())
