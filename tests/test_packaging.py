"""The wheel's package list is written out by hand (export/ is installed as kda_ops_export): every package of
the source tree must be in it."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    mapped = {name: path for name, path in conf.get("package-dir", {}).items()}
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kda_ops").rglob("__init__.py")}
    on_disk |= {name for name, path in mapped.items() if (ROOT / path / "__init__.py").exists()}
    assert on_disk <= listed, f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
