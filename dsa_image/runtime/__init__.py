"""What the image runs: its entrypoint, healthcheck, warm-up and self-test."""
