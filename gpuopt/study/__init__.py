"""The stored study format, torch-free: every attr key, the rules that read them (status,
feasibility, baseline/best/same-training picks), typed records, storage and export. Both the
sweeper (which writes) and the report (which reads) import it; it imports neither.
"""
