"""Figures drawn in the course's style write the novel's text: every one of its 200 most
frequent characters has a glyph (matplotlib warns "Glyph … missing from font(s)" otherwise)."""

import logging
import warnings
from collections import Counter

import matplotlib
import matplotlib.pyplot as plt
import pytest

from tpedu.course.style import _regular_weight_only, use_course_style
from tpedu.data.corpus import load_novel


def missing_glyphs(text: str) -> list[str]:
    """The missing-glyph warnings of a figure whose title is `text`, drawn now."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig, ax = plt.subplots()
        ax.set_title(text)
        fig.canvas.draw()
        plt.close(fig)
    return [str(w.message) for w in caught if "missing from font" in str(w.message)]


@pytest.fixture(scope="module")
def frequent_characters() -> str:
    text = load_novel()
    counts = Counter(c for c in text if not c.isspace())
    return "".join(c for c, _ in counts.most_common(200))


def test_the_course_style_draws_the_200_most_frequent_characters(frequent_characters):
    with matplotlib.rc_context():
        use_course_style()
        assert missing_glyphs(frequent_characters) == []


def test_matplotlibs_default_font_would_miss_them(frequent_characters):
    """The check above can fail: matplotlib's own font lacks the novel's characters."""
    with matplotlib.rc_context(matplotlib.rcParamsDefault):
        assert len(missing_glyphs(frequent_characters)) > 100


def test_bold_chinese_is_drawn_regular_without_a_warning_in_the_output():
    """Only Noto's Regular weight ships: matplotlib's note about it would land in every
    notebook output under a bold title; the course drops that note and no other."""
    use_course_style()
    font_log = logging.getLogger("matplotlib.font_manager")
    assert _regular_weight_only in font_log.filters

    def record(message: str) -> logging.LogRecord:
        return font_log.makeRecord(font_log.name, logging.WARNING, "", 0, message, (), None)

    bold = "findfont: Failed to find font weight bold for Noto Sans CJK SC, now using 400."
    assert not font_log.filter(record(bold))
    assert font_log.filter(record("findfont: Font family 'Nope' not found."))
