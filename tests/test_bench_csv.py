"""benchmarks/_common.append_csv: rows join the file under the union of columns, and a
damaged file never costs a run its rows."""

from __future__ import annotations

import csv

import pytest
from helpers import bench_module


@pytest.fixture
def common(tmp_path, monkeypatch):
    module = bench_module("_common")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    monkeypatch.setenv("EXPERTCACHE_COMMIT", "abc1234")
    return module


def read(path):
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_rows_append_under_the_union_of_columns(common, tmp_path):
    common.append_csv("bench", [{"variant": "a", "ms": 1.5}])
    common.append_csv("bench", [{"variant": "b", "ratio": 1.1}])
    rows = read(tmp_path / "bench.csv")
    assert [(row["variant"], row["ms"], row["ratio"], row["commit"]) for row in rows] == [
        ("a", "1.5", "", "abc1234"),
        ("b", "", "1.1", "abc1234"),
    ]
    assert b"\r" not in (tmp_path / "bench.csv").read_bytes()  # one line end, so a rewrite is a small diff


def test_a_file_with_rows_longer_than_its_header_is_left_alone_and_the_rows_go_aside(common, tmp_path):
    damaged = tmp_path / "bench.csv"
    damaged.write_text("variant,ms\na,1.0\nb,2.0,on,on\n")
    for variant in ("c", "d"):  # a second run against the same file keeps the first one's rows too
        with pytest.raises(ValueError, match=r"bench.csv: line 3 has more cells than the header; .*bench.unmerged-"):
            common.append_csv("bench", [{"variant": variant, "ms": 3.0}])
    assert damaged.read_text() == "variant,ms\na,1.0\nb,2.0,on,on\n"
    aside = sorted(tmp_path.glob("bench.unmerged-*.csv"))
    assert [[(row["variant"], row["ms"]) for row in read(path)] for path in aside] == [[("c", "3.0")], [("d", "3.0")]]
