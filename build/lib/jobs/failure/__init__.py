"""Staying up: signals, the watchdog and heartbeats, incident classification, the requeue budget."""
