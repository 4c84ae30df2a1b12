"""The notebook side: the ``%%mlxgen`` magics, the widget, kernel hooks and ``{name}`` interpolation.

Only this package imports IPython, ipykernel or ipywidgets.
"""
