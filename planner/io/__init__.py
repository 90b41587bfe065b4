"""Input and output: plan files (format, validation), predicted-vs-measured comparison and the
command line."""
