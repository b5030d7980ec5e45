#!/bin/bash
# The verifier: 1 in /logs/verifier/reward.txt when the unit tests of /app/wordcount.py pass, else 0.
if python3 /tests/test_wordcount.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
