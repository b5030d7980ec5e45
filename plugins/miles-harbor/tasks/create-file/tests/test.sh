#!/bin/bash
# The verifier: 1 in /logs/verifier/reward.txt when /app/output/greeting.txt is exactly "Hello, Harbor!\n", else 0.
if printf 'Hello, Harbor!\n' | cmp -s - /app/output/greeting.txt; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
