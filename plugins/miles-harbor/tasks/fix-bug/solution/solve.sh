#!/bin/bash
sed -i 's/counts\[word\] = 1$/counts[word] = counts.get(word, 0) + 1/' /app/wordcount.py
