"""Profiling the data path: `mmrl profile-data` (data_profile.py measures, advice.py explains,
output.py writes report.json / report.md / trace.json / chart.png). See docs/profiling.md."""
