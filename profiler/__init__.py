"""Runtime profiler (`synccheck profile -- CMD`): counts all-reduces per optimizer step in every rank."""
