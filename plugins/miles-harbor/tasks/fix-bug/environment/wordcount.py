"""Count the words of a text."""


def word_counts(text):
    """How often each word occurs in ``text``, case-insensitively, without the punctuation around it."""
    counts = {}
    for word in text.split():
        word = word.strip(".,;:!?\"'()").lower()
        if word:
            counts[word] = 1
    return counts
