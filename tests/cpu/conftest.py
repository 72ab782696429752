import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def private_temporary_folder(tmp_path_factory):
    """The benchmark drivers write shapes under a fixed folder of the temporary directory
    (``shapes.shape_root``) so that real runs share compile caches; tests write theirs
    under pytest's own folder instead, apart from real runs and from other test runs."""
    earlier = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    yield
    tempfile.tempdir = earlier
