"""The samples granary ingests from WebDataset tars are the ones `webdataset.WebDataset` yields
for the same tars, case by case (issue 23). Skipped where webdataset is not installed; CI
installs it (webdataset 1.0.2)."""

import gzip
import io
import os
import shutil
import tarfile

import pytest

import granary

wds = pytest.importorskip("webdataset")


def add(tar, name, data=None, kind=tarfile.REGTYPE, link=None):
    info = tarfile.TarInfo(name)
    info.type = kind
    if link is not None:
        info.linkname = link
    if data is None or kind != tarfile.REGTYPE:
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def make_tar(path, members, fmt=tarfile.GNU_FORMAT):
    with tarfile.open(path, "w", format=fmt) as tar:
        for member in members:
            add(tar, *member)
    return str(path)


def from_webdataset(url):
    out = []
    for sample in wds.WebDataset(url, shardshuffle=False, empty_check=False):
        out.append((sample["__key__"], {k: v for k, v in sample.items() if not k.startswith("__")}))
    return out


def from_granary(store, name, inputs):
    store.ingest_tars(name, inputs, mode="replace")
    loader = store.loader(name, batch_size=1000, order="sequential", device="cpu", output="numpy")
    out = []
    for batch in loader:
        for sample in batch:
            out.append((sample["__key__"], {k: v for k, v in sample.items() if k != "__key__"}))
    return out


CASES = {
    "plain": [("000.jpg", b"j0"), ("000.cls", b"0"), ("001.jpg", b"j1"), ("001.cls", b"1")],
    "dot-slash prefixes": [("./000.jpg", b"j0"), ("./000.txt", b"t0"), ("./001.jpg", b"j1")],
    "dotted directories": [("a.b/000.jpg", b"j0"), ("a.b/000.txt", b"t0"), ("c.d/000.jpg", b"j1")],
    "multi-dot names": [("000.seg.png", b"s"), ("000.jpg", b"j"), ("001.seg.png", b"s1")],
    "links": [("000.jpg", b"j"), ("000.txt", None, tarfile.SYMTYPE, "000.jpg"), ("001.jpg", b"k")],
    "interleaved keys": [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.txt", b"3")],
    "GNU long names": [("d" * 120 + "/000.jpg", b"j"), ("d" * 120 + "/000.txt", b"t")],
    "AppleDouble": [
        ("._000.jpg", b"mac"),
        ("000.jpg", b"j0"),
        ("._000.txt", b"mac"),
        ("000.txt", b"t0"),
        ("._001.jpg", b"mac"),
        ("001.jpg", b"j1"),
    ],
    "dotfiles": [(".DS_Store", b"x"), ("000.jpg", b"j"), ("dir/.hidden.txt", b"h"), ("001.jpg", b"k")],
    "no extension": [("README", b"r"), ("000.jpg", b"j"), ("docs/LICENSE", b"l"), ("001.jpg", b"k")],
    "metadata": [("__meta__", b"m"), ("000.jpg", b"j"), ("__index__/000.json", b"{}"), ("001.jpg", b"k")],
    "upper-case extensions": [("000.JPG", b"j"), ("000.Txt", b"t"), ("001.jpg", b"k")],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_tar_gives_the_same_samples_as_webdataset(store, tmp_path, case):
    path = make_tar(tmp_path / "case.tar", CASES[case])
    expected = from_webdataset(path)
    assert expected, "webdataset yields samples here"
    with pytest.warns(UserWarning) if case in ("links",) else _nothing():
        got = from_granary(store, "c", path)
    assert got == expected


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_part_twice_in_a_sample_is_refused_as_webdataset_refuses_it(store, tmp_path):
    path = make_tar(tmp_path / "dup.tar", [("x.jpg", b"1"), ("x.JPG", b"2")])
    with pytest.raises(ValueError):
        from_webdataset(path)
    with pytest.raises(granary.Error, match="already has a part of that name"):
        store.ingest_tars("dup", path)


def test_compressed_tars_patterns_urls_and_directories_are_read(store, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        make_tar(shards / f"shard-{i:03}.tar", [(f"{i}-a.jpg", b"a%d" % i), (f"{i}-b.jpg", b"b%d" % i)])
    plain = str(shards / "shard-000.tar")
    with open(plain, "rb") as src, gzip.open(tmp_path / "shard-000.tar.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(tmp_path / "shard-000.tar.gz", tmp_path / "shard-000.tgz")
    whole = from_webdataset(str(shards / "shard-{000..002}.tar"))
    assert len(whole) == 6
    for inputs, url in [
        (str(tmp_path / "shard-000.tar.gz"), str(tmp_path / "shard-000.tar.gz")),
        (str(tmp_path / "shard-000.tgz"), str(tmp_path / "shard-000.tgz")),
        (str(shards / "shard-{000..002}.tar"), str(shards / "shard-{000..002}.tar")),
        ("file:" + str(shards / "shard-001.tar"), "file:" + str(shards / "shard-001.tar")),
        (
            str(shards / "shard-000.tar") + "::" + str(shards / "shard-002.tar"),
            str(shards / "shard-000.tar") + "::" + str(shards / "shard-002.tar"),
        ),
        (str(shards), str(shards / "shard-{000..002}.tar")),
    ]:
        assert from_granary(store, "p", inputs) == from_webdataset(url), inputs
    with pytest.raises(granary.Error, match="pipe: URLs run a shell command"):
        store.ingest_tars("p", "pipe:cat " + plain)
