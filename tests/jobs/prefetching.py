"""apex's data_prefetcher as a generator, for the jobs here (each imports it from its own folder):
the next batch is fetched before the one in hand is used, so a pass over the loader ends before
its last batch's backward."""


def one_ahead(batches):
    it = iter(batches)
    ahead = next(it, None)
    while ahead is not None:
        batch, ahead = ahead, next(it, None)
        yield batch
