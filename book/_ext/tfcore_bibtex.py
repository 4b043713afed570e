"""Citation labels of the book: the alpha labels ([VSP+17]), except where an entry names its own.

sphinxcontrib-bibtex's default style, alpha, builds a label from the authors and the year. The
source notes have no authors, only the name "Source note 004", which alpha turns into
[Sourcen00425]. An entry with a ``shorthand`` field (biblatex's name for a label chosen by
hand) is cited by that field instead: ``shorthand = {note 004}`` gives [note 004]. Every other
entry keeps its alpha label, and the bibliography keeps alpha's order and formatting.

Loaded as a local Sphinx extension (``sphinx.local_extensions`` in _config.yml), which
registers the style ``tfcore`` that ``bibtex_default_style`` selects.
"""
from __future__ import annotations

from pybtex.plugin import register_plugin
from pybtex.style.formatting.alpha import Style as AlphaStyle
from pybtex.style.labels.alpha import LabelStyle as AlphaLabelStyle


class LabelStyle(AlphaLabelStyle):
    def format_label(self, entry):
        shorthand = entry.fields.get("shorthand", "").strip()
        return shorthand or super().format_label(entry)


class Style(AlphaStyle):
    default_label_style = "tfcore"


def setup(app):
    register_plugin("pybtex.style.labels", "tfcore", LabelStyle)
    register_plugin("pybtex.style.formatting", "tfcore", Style)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
