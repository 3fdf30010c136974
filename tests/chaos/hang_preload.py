"""A preload that never finishes importing (the launcher's standby must not wait for it)."""
import time

time.sleep(3600)
