"""Input and output: plan files (the entry planfile, the writer planwrite, the reader and validator
planvalidate), the DeepSpeed bridge (deepspeed/), predicted-vs-measured comparison and the command line."""
