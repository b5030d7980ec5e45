"""Unit tests of /app/wordcount.py (standard library only)."""

import sys
import unittest

sys.path.insert(0, "/app")

from wordcount import word_counts  # noqa: E402


class WordCounts(unittest.TestCase):
    def test_counts_repeated_words(self):
        self.assertEqual(word_counts("the cat and the hat"), {"the": 2, "cat": 1, "and": 1, "hat": 1})

    def test_ignores_case_and_punctuation(self):
        self.assertEqual(word_counts("Go, go, GO!"), {"go": 3})

    def test_empty_text(self):
        self.assertEqual(word_counts(""), {})


if __name__ == "__main__":
    unittest.main()
