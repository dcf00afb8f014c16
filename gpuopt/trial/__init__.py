"""The torch side of one trial's process: devices, policies (precision, cache/allocator, compile), the
timed window, monitors, profiles, the numerics guard, and the processes the sweeper starts for
interleaved confirmation and the memory probe.
"""
