"""docs/ARCHITECTURE.md's internals table is rendered from the compat registry."""

import pathlib
import re

from keras_dist.compat import registry

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"


def test_registry_table_in_architecture_doc_matches_the_code():
    text = DOC.read_text()
    match = re.search(r"<!-- registry:begin -->\n(.*?)\n<!-- registry:end -->", text, re.S)
    assert match, "docs/ARCHITECTURE.md lost its registry markers"
    assert match.group(1) == registry.render_markdown(), (
        "docs/ARCHITECTURE.md is out of date: paste "
        "keras_dist.compat.registry.render_markdown() between the registry markers"
    )


def test_every_module_in_the_layout_table_exists():
    # The concept table names packages (`cluster/`) and the modules in them
    # (`config.py`); a module moved or renamed must be moved in the page too.
    package_root = DOC.parent.parent / "keras_dist"
    rows = [line for line in DOC.read_text().splitlines()
            if line.startswith("| ") and "`" in line.split("|")[2]]
    assert len(rows) >= 10, "docs/ARCHITECTURE.md lost its concept table"
    missing = []
    for row in rows:
        package = package_root
        for name in re.findall(r"`([\w/.]+)`", row.split("|")[2]):
            if name.endswith("/"):
                package = package_root / name
                candidates = [package]
            elif name.endswith(".py"):
                candidates = [package / name.rsplit("/", 1)[-1], package_root / name]
            else:
                candidates = [package / f"{name}.py"]
            if not any(path.exists() for path in candidates):
                missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"
