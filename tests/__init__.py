"""The test suite.

unit/ runs in one process without Ray; integration/ uses real Ray, energon and torch;
reliability/ kills, damages and resumes runs; support/ is what they share.
"""
