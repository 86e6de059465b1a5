"""Scheduling and KV-cache bookkeeping: plain Python over integers, no torch."""
