"""benchmarks/table.py: the README speed table from benchmarks/results/kda.csv (CPU, standard library only)."""
import importlib.util
import io
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_table():
    spec = importlib.util.spec_from_file_location("kda_bench_table", os.path.join(ROOT, "benchmarks", "table.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


table = _load_table()

HEADER = "date,commit,gpu,torch,triton,fla,provider,mode,regime,B,T,H,K,V,ms,peak_extra_mib\n"
# An older run, a newer run (strong regime only in the newer one), a kda_ops-only run of another shape, and
# an FLA row of another run that must not be paired with the newer kda_ops row.
FIXTURE = HEADER + """\
2026-01-01,aaaaaaa,GPU X,2.11,3.6,0.6.0,kda_ops,fwd,weak,1,64,2,16,16,2.0000,
2026-01-01,aaaaaaa,GPU X,2.11,3.6,0.6.0,fla,fwd,weak,1,64,2,16,16,3.0000,
2026-01-02,bbbbbbb,GPU X,2.11,3.6,0.6.0,kda_ops,fwd,weak,1,64,2,16,16,1.0000,10.0
2026-01-02,bbbbbbb,GPU X,2.11,3.6,0.6.0,fla,fwd,weak,1,64,2,16,16,1.5000,20.0
2026-01-02,bbbbbbb,GPU X,2.11,3.6,0.6.0,kda_ops,fwdbwd,strong,1,64,2,16,16,4.0000,30.0
2026-01-02,bbbbbbb,GPU X,2.11,3.6,0.6.0,fla,fwdbwd,strong,1,64,2,16,16,5.0000,40.0
2026-01-02,bbbbbbb,GPU X,2.11,3.6,0.6.0,kda_ops,fwd,strong,1,64,2,16,16,0.5000,5.0
2026-01-02,bbbbbbb,GPU X,2.11,3.6,,kda_ops,fwd,safe_gate,1,32,2,16,16,0.2500,1.0
2026-01-03,ccccccc,GPU X,2.11,3.6,0.6.0,fla,fwd,safe_gate,1,32,2,16,16,9.0000,9.0
"""

EXPECTED = """\
GPU X, torch 2.11, triton 3.6; bf16, gate + q/k l2norm + beta sigmoid inside the op.
GPU X, torch 2.11, triton 3.6, FLA 0.6.0; bf16, gate + q/k l2norm + beta sigmoid inside the op.

| B, T, H, K, V | gate regime | pass | kda_ops ms | FLA ms | speed-up vs FLA | peak memory vs FLA |
|---|---|---|---|---|---|---|
| 1, 32, 2, 16, 16 | safe_gate | forward | 0.250 | - | - | - |
| 1, 64, 2, 16, 16 | weak | forward | 1.000 | 1.500 | 1.50x | 0.50 |
| 1, 64, 2, 16, 16 | strong | forward | 0.500 | - | - | - |
| 1, 64, 2, 16, 16 | strong | fwd + bwd | 4.000 | 5.000 | 1.25x | 0.75 |
"""


def _rows(text):
    import csv
    return list(csv.DictReader(io.StringIO(text)))


def test_render_fixture():
    assert table.render(_rows(FIXTURE)) == EXPECTED


def test_missing_peer_keeps_the_run_header():
    # a run with FLA installed whose FLA row is missing is still the FLA run: no header line of its own
    rows = [r for r in _rows(FIXTURE) if r["regime"] != "safe_gate"]
    out = table.render(rows)
    assert out.splitlines()[0] == ("GPU X, torch 2.11, triton 3.6, FLA 0.6.0; bf16, gate + q/k l2norm + beta sigmoid "
                                   "inside the op.")
    assert out.splitlines()[1] == ""


def test_latest_row_wins_on_equal_dates():
    extra = "2026-01-02,bbbbbbb,GPU X,2.11,3.6,0.6.0,kda_ops,fwd,weak,1,64,2,16,16,0.7500,10.0\n"
    out = table.render(_rows(FIXTURE + extra))
    assert "| 1, 64, 2, 16, 16 | weak | forward | 0.750 | 1.500 | 2.00x | 0.50 |" in out


def test_rows_of_two_gpus_name_their_gpu():
    extra = ("2026-01-04,ddddddd,GPU Y,2.11,3.6,0.6.0,kda_ops,fwd,weak,1,64,2,16,16,0.8000,10.0\n"
             "2026-01-04,ddddddd,GPU Y,2.11,3.6,0.6.0,fla,fwd,weak,1,64,2,16,16,2.0000,20.0\n")
    lines = table.render(_rows(FIXTURE + extra)).splitlines()
    assert "GPU Y, torch 2.11, triton 3.6, FLA 0.6.0; bf16, gate + q/k l2norm + beta sigmoid inside the op." in lines
    assert "| B, T, H, K, V | gate regime | pass | GPU | kda_ops ms | FLA ms | speed-up vs FLA | peak memory vs FLA |" \
        in lines
    assert "| 1, 64, 2, 16, 16 | weak | forward | GPU Y | 0.800 | 2.000 | 2.50x | 0.50 |" in lines
    assert "| 1, 64, 2, 16, 16 | strong | fwd + bwd | GPU X | 4.000 | 5.000 | 1.25x | 0.75 |" in lines
    assert "|" + "---|" * 8 in lines


def test_update_replaces_between_markers_only():
    readme = f"intro\n{table.START}\nold table\n{table.END}\noutro\n"
    assert table.update(readme, "new\n") == f"intro\n{table.START}\nnew\n{table.END}\noutro\n"
    with pytest.raises(ValueError):
        table.update("no markers\n", "new\n")


def test_csv_columns_match_bench_kda():
    with open(table.CSV_PATH) as fh:
        assert fh.readline() == HEADER
    with open(os.path.join(ROOT, "benchmarks", "bench_kda.py")) as fh:
        src = fh.read()
    cols = HEADER.strip().split(",")
    assert 'CSV_COLUMNS = ["date", "commit", "gpu", "torch", "triton", "fla", "provider", "mode", "regime",' in src
    assert all(f'"{c}"' in src for c in cols)


def test_readme_table_is_up_to_date():
    """A stale README (kda.csv changed without `python benchmarks/table.py`) fails here."""
    with open(table.README_PATH) as fh:
        readme = fh.read()
    expected = table.update(readme, table.render(table.read_rows(table.CSV_PATH)))
    assert readme == expected, "README speed table is stale: run python benchmarks/table.py"
