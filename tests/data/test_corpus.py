"""data/corpus.py: the function prompts cut from a source file keep the source as written,
dedented by the function's own indent."""

from __future__ import annotations

from prove_jax.data import corpus


ODD_METHOD = '''\
class K:
    def kept(self):
        """Doc."""
        return 1

    def odd(self):
        """Doc."""
        s = """
col0
"""
        return s
'''


def test_a_function_with_a_line_left_of_its_indent_is_skipped_not_mangled():
    records = corpus.function_prompts(corpus.SourceFile("m.py", ODD_METHOD))
    assert [r["id"] for r in records] == ["stdlib/m.py:K.kept:2"]
    # what is kept is the source, dedented by the method's indent and nothing else
    lines = ODD_METHOD.splitlines(keepends=True)
    assert ["    " + ln for ln in (records[0]["prompt"] + records[0]["reference"]).splitlines(keepends=True)] \
        == lines[1:4]
