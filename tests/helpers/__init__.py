"""Programs and servers the tests start in other processes (workers, a GCS emulator, instrumented train.py)."""
