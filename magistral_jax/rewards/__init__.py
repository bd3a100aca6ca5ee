"""Rewards (paper §2): format gate, math and code correctness, length penalty, language bonus."""
