"""The study (USA-NA-AIO 2025 Round 2, Problem 2) in its own names, and the tour that answers its 14 parts.

- usaaio.py  MyMHA, MyGQA, GQA_2_MLA, reduced_matrices, ...: thin wrappers over the library
- tour.py    each part answered by running the library, every answer checked
"""
