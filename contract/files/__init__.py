"""The files a rank and its daemon share, and the safe ways to write them."""
