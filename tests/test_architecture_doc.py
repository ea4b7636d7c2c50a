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
