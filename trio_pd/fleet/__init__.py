"""Worker fleet: registry, selection policies, circuit breakers, health checks, retry timing.

Pure logic plus trio timing (`trio.current_time()` only); nothing here knows HTTP.
"""
