#!/bin/bash
printf 'Hello, Harbor!\n' > /app/output/greeting.txt
