"""research/study51/file_pair.sh: a pair call's return filed as research/data/README.md says (the stream gzip'd and
the runs archive recompressed with xz, both byte for byte the same inside), and refused when incomplete or already
filed."""

from __future__ import annotations

import gzip
import io
import lzma
import os
import shutil
import subprocess
import tarfile

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "study51", "file_pair.sh")
NAMES = ("study51-b-s9-a", "study51-b-s9-b")
if shutil.which("xz") is None:
    pytest.skip("the script recompresses with xz, which this machine lacks", allow_module_level=True)


def tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture()
def returned(tmp_path):
    """What a study51-pair call returns: each list's stream and analysis, and the pair archive (logs, analyses, runs
    archives, the call's record of each list)."""
    out = tmp_path / "returned"
    out.mkdir()
    pair = {}
    for name in NAMES:
        (out / f"{name}-stream.jsonl").write_text(f'{{"tag": "{name}", "step": 1}}\n')
        (out / f"{name}-analysis.md").write_text(f"| {name} |\n")
        pair[f"./{name}-analysis.md"] = f"| {name} |\n".encode()
        pair[f"./{name}.log"] = f"log of {name}\n".encode()
        pair[f"./{name}-runs.tar.gz"] = tar_gz({f"{name}/metrics.jsonl": b"{}\n"})
        pair[f"./study51-pair-{name}.txt"] = b"== study51\n"
    (out / "study51-pair.tar.gz").write_bytes(tar_gz(pair))
    return out, pair


def file_pair(returned_dir, data):
    return subprocess.run(["bash", SCRIPT, str(returned_dir), *NAMES], capture_output=True, text=True,
                          env=dict(os.environ, STUDY_DATA=str(data)))


def test_each_list_is_filed_compressed_with_its_contents_unchanged(returned, tmp_path):
    out, pair = returned
    data = tmp_path / "data"
    data.mkdir()
    proc = file_pair(out, data)
    assert proc.returncode == 0, proc.stderr
    for name in NAMES:
        folder = data / name
        assert sorted(os.listdir(folder)) == sorted([f"{name}-stream.jsonl.gz", f"{name}-analysis.md", f"{name}.log",
                                                     f"{name}-runs.tar.xz", f"study51-pair-{name}.txt"])
        assert gzip.decompress((folder / f"{name}-stream.jsonl.gz").read_bytes()) == (out / f"{name}-stream.jsonl").read_bytes()
        assert lzma.decompress((folder / f"{name}-runs.tar.xz").read_bytes()) == gzip.decompress(pair[f"./{name}-runs.tar.gz"])
        assert (folder / f"{name}.log").read_bytes() == pair[f"./{name}.log"]


def test_an_incomplete_return_or_a_filed_list_is_refused_and_nothing_is_written(returned, tmp_path):
    out, _ = returned
    data = tmp_path / "data"
    data.mkdir()
    (out / f"{NAMES[1]}-stream.jsonl").unlink()
    proc = file_pair(out, data)
    assert proc.returncode == 1 and f"{NAMES[1]}-stream.jsonl: not returned" in proc.stderr
    assert os.listdir(data) == []
    (out / f"{NAMES[1]}-stream.jsonl").write_text("{}\n")
    (data / NAMES[0]).mkdir()
    proc = file_pair(out, data)
    assert proc.returncode == 1 and "exists: not overwritten" in proc.stderr and os.listdir(data) == [NAMES[0]]
