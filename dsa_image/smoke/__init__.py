"""Smoke test of a GLM-5 DSA server: start it (Docker image or a local `vllm serve`), wait for
it while following its log, run the checks, write a JSON report and the server log.

Stdlib only, except `dsa_image.smoke.docker_runtime`, which imports the Docker SDK when used.
"""
