"""Real vLLM beside kvlab: ``bridge`` starts ``worker.py`` in vLLM's own venv and reads back
JSON."""
