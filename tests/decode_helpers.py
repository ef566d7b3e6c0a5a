"""Requests shared by the decoding test files that compare a run with greedy AR: six prompts of
the small random model of tests/test_decoding.py, decoded without EOS."""

from tests.test_decoding import _prompts

PROMPTS = _prompts(6, (20, 3, 9, 2, 17))
NEW = 24
NO_EOS = [-1]
