"""``benchmarks.plot_results``: the names its legends give the bench's server kinds (no matplotlib needed)."""

from benchmarks.plot_results import kind_label


def test_every_kind_the_bench_starts_gets_a_readers_name():
    assert kind_label("kdtree", 64) == "KDTREE budget 64"
    assert kind_label("kdtree", None) == "KDTREE"
    assert kind_label("kdtree-15", 64) == "KDTREE budget 15"
    assert kind_label("kdtree-auto", 64) == "KDTREE automatic width"
    assert kind_label("kdtree-auto-log", 64) == "KDTREE automatic width (round log on)"
    assert kind_label("kdtree-log", 64) == "KDTREE (kdtree-log)"


def test_an_overlapped_kind_is_its_kind_with_overlap_on():
    assert kind_label("kdtree-63-overlap", 64) == "KDTREE budget 63, overlap on"
    assert kind_label("kdtree-overlap", 64) == "KDTREE budget 64, overlap on"
    assert kind_label("kdtree-auto-overlap", 64) == "KDTREE automatic width, overlap on"
