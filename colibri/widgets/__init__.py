"""Engine telemetry as pictures: `plots` (matplotlib figures) and `views` (live ipywidgets)."""
