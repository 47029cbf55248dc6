"""read_inside checks the file it actually opened: a symlink planted in the root (or a folder on
the way replaced by one) leading outside is refused at the moment of reading; symlinks that stay
inside are followed; a FIFO is refused without blocking."""

import os

import pytest

from mmtune.io.confined import OutsideRoot, read_inside


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "a.png").write_bytes(b"inside")
    (outside / "secret.png").write_bytes(b"secret")
    return root, outside


def test_a_file_inside_and_a_symlink_that_stays_inside_are_read(tree):
    root, _ = tree
    os.symlink(root / "sub" / "a.png", root / "link.png")
    assert read_inside(str(root / "sub" / "a.png"), str(root)) == b"inside"
    assert read_inside(str(root / "link.png"), str(root)) == b"inside"


@pytest.mark.parametrize("how", ["file_link", "folder_link", "relative_link", "dotdot_path"])
def test_every_way_out_of_the_root_is_refused_when_opened(tree, how):
    root, outside = tree
    path = root / "sub" / "a.png"
    if how == "file_link":  # the checked file replaced by a symlink
        path.unlink()
        os.symlink(outside / "secret.png", path)
    elif how == "folder_link":  # a folder on the way replaced by one
        (root / "sub" / "a.png").unlink()
        (root / "sub").rmdir()
        os.symlink(outside, root / "sub")
        path = root / "sub" / "secret.png"
    elif how == "relative_link":
        path.unlink()
        os.symlink("../../outside/secret.png", path)
    else:
        path = root / "sub" / ".." / ".." / "outside" / "secret.png"
    with pytest.raises(OutsideRoot, match="outside the image root"):
        read_inside(str(path), str(root))
    assert read_inside(str(path), None) == b"secret"  # not confined: read as it is


def test_a_fifo_is_refused_without_waiting_for_a_writer(tree):
    root, _ = tree
    os.mkfifo(root / "pipe.png")
    with pytest.raises(OutsideRoot, match="not a regular file"):
        read_inside(str(root / "pipe.png"), str(root))
