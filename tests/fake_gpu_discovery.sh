#!/usr/bin/env bash
# Spark GPU discovery script for tests: every worker reports three GPUs with ids 0, 1, 2.
echo '{"name": "gpu", "addresses": ["0", "1", "2"]}'
