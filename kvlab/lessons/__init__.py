"""Lesson code: one module per notebook (its experiments, figures ``fig_*`` and exercise
checkers)."""
