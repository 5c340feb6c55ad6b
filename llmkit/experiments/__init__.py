"""The code behind ``bench/``: workloads, measurements and baselines, tested and reusable.

The method packages never import this one; ``bench/<name>.py`` scripts stay thin and call in here.
"""
