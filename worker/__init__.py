"""The Celery service: a thin shell over `pipeline` (see worker/app.py)."""
