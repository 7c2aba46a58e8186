"""Course infrastructure: the figures' style, so that a figure can write the novel's text.

Matplotlib's own font, DejaVu Sans, has no Chinese characters: a title like 却说宝玉 would come
out as empty boxes (and a "Glyph … missing from font" warning). The course registers Noto Sans
CJK SC, which the `mplfonts` package ships (installed with the course; its OFL-licensed font
file is used as it lies, nothing is copied into matplotlib), behind DejaVu Sans: Latin text and
digits keep matplotlib's look, and each Chinese character falls back to Noto.

Importing `tpedu.course` applies it, so every lesson's figures have it.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import matplotlib
from matplotlib import font_manager

LATIN_FAMILY = "DejaVu Sans"  # matplotlib's own
CJK_FAMILY = "Noto Sans CJK SC"


def cjk_font_file() -> Path:
    """The Noto Sans CJK SC font file that mplfonts installs (found without importing it)."""
    spec = importlib.util.find_spec("mplfonts")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the font for Chinese text is missing: run `make setup` (or pip install mplfonts)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "fonts" / "NotoSansCJKsc-Regular.otf"


def use_course_style() -> None:
    """Register the CJK font and draw text in DejaVu Sans, then Noto Sans CJK SC for what it
    lacks. Named families, not the generic "sans-serif": matplotlib falls back from glyph to
    glyph only along font.family's list; a generic name resolves to its first font alone."""
    if CJK_FAMILY not in {f.name for f in font_manager.fontManager.ttflist}:
        font_manager.fontManager.addfont(str(cjk_font_file()))
        logging.getLogger("matplotlib.font_manager").addFilter(_regular_weight_only)
    matplotlib.rcParams["font.family"] = [LATIN_FAMILY, CJK_FAMILY]


def _regular_weight_only(record: logging.LogRecord) -> bool:
    """Only the Regular weight ships, so bold Chinese is drawn regular: matplotlib says so for
    every bold title ("Failed to find font weight bold for Noto Sans CJK SC"), which is noise."""
    return not (CJK_FAMILY in record.getMessage() and "font weight" in record.getMessage())
