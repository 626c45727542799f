"""
The human-evaluation kit of the paper's Table 2 (Appendix A.4): raters see a prefix and two
continuations from two systems, in random order and without names, and pick the better one (or
'equal'). Attention checks pit a system against the real continuation; raters who prefer the
system there more often than allowed are dropped.

    python human_eval.py export --samples out/samples.json --systems joint,base --out_dir out/human_eval
        -> items.csv and items.jsonl for raters; key.json stays with you
    python human_eval.py score --key out/human_eval/key.json --votes votes.csv
        votes.csv columns: rater,item,choice   (choice: A, B or equal)

Reports, for system 1 over system 2: the preference rate (strictly better), the not-worse rate
(better or equal), and the one-sided binomial p-value of wins against losses (ties dropped).
"""

import csv
import json
import math
import os
import random

from data import read_json, write_json
from runtime import ArgumentParser, at_least, check_writable, run_main


def binomial_p_value(wins, losses):
    """P(X >= wins) for X ~ Binomial(wins + losses, 1/2): one-sided test of 'no preference'."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def export(samples, systems, num_checks, seed):
    """Items (shuffled, A/B order random) and the key that unblinds them."""
    rng = random.Random(seed)
    s1, s2 = systems
    pairs = [(r['prefix'], (s1, r[s1]), (s2, r[s2]), False) for r in samples]
    if num_checks:
        if 'gold' not in samples[0]:
            raise ValueError("attention checks need real continuations: sample data prefixes (--split), not --prompt")
        pairs += [(r['prefix'], (s1, r[s1]), ('gold', r['gold']), True)
                  for r in rng.sample(samples, min(num_checks, len(samples)))]
    rng.shuffle(pairs)
    items, key = [], {}
    for i, (prefix, x, y, check) in enumerate(pairs):
        a, b = (x, y) if rng.random() < 0.5 else (y, x)
        items.append(dict(item=i, prefix=prefix, A=a[1], B=b[1]))
        key[str(i)] = dict(A=a[0], B=b[0], check=check)
    return items, dict(systems=systems, items=key)


def score(key, votes, max_failed_checks=0):
    """Preference of systems[0] over systems[1] from votes [(rater, item, choice)]."""
    s1, s2 = key['systems']
    failed = {}
    for rater, item, choice in votes:
        k = key['items'][item]
        if k['check'] and choice in ('A', 'B') and k[choice] != 'gold':
            failed[rater] = failed.get(rater, 0) + 1
    dropped = sorted(r for r, n in failed.items() if n > max_failed_checks)
    wins = losses = ties = 0
    for rater, item, choice in votes:
        k = key['items'][item]
        if k['check'] or rater in dropped:
            continue
        if choice == 'equal':
            ties += 1
        elif k[choice] == s1:
            wins += 1
        else:
            losses += 1
    n = wins + losses + ties
    return dict(system=s1, versus=s2, votes=n, wins=wins, losses=losses, ties=ties, dropped_raters=dropped,
                preferred=wins / n if n else float('nan'), not_worse=(wins + ties) / n if n else float('nan'),
                p_value=binomial_p_value(wins, losses))


def read_votes(path, key):
    with open(path, newline='') as f:
        votes = [(r['rater'], r['item'], r['choice'].strip()) for r in csv.DictReader(f)]
    for rater, item, choice in votes:
        if item not in key['items'] or choice not in ('A', 'B', 'equal'):
            raise ValueError(f"bad vote ({rater}, {item}, {choice}) in {path}: item must be in the key and choice A, B or equal")
    return votes


def main(argv=None):
    p = ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest='cmd', required=True)
    e = sub.add_parser('export', help='write items for raters and the key')
    e.add_argument('--samples', default='out/samples.json', help="sample.py's JSON output")
    e.add_argument('--systems', default='joint,base', help='the two systems compared (base, joint, worst, gold)')
    e.add_argument('--checks', type=int, default=2, help='attention-check items (system vs real text)')
    e.add_argument('--out_dir', default='out/human_eval')
    e.add_argument('--seed', type=int, default=1337)
    s = sub.add_parser('score', help='read votes back and report the preference')
    s.add_argument('--key', default='out/human_eval/key.json')
    s.add_argument('--votes', required=True, help='CSV with columns rater,item,choice')
    s.add_argument('--max_failed_checks', type=int, default=0, help='drop raters failing more checks than this')
    s.add_argument('--out', default=None, help='JSON report (default: beside the votes)')
    args = p.parse_args(argv)
    if args.cmd == 'export':
        at_least(args, 0, 'checks')
        check_writable(args.out_dir, '--out_dir')
        samples = read_json(args.samples, "give sample.py's --out")
        if not isinstance(samples, dict) or not isinstance(samples.get('samples'), list) or not samples['samples']:
            raise ValueError(f"--samples {args.samples} holds no samples (a 'samples' list, as sample.py writes)")
        samples = samples['samples']
        systems = args.systems.split(',')
        if len(systems) != 2 or any(sys_ not in samples[0] for sys_ in systems):
            raise ValueError(f"--systems must name two of {[k for k in ('base', 'joint', 'worst', 'gold') if k in samples[0]]}")
        items, key = export(samples, systems, args.checks, args.seed)
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, 'items.csv'), 'w', newline='') as f:
            w = csv.DictWriter(f, fieldnames=['item', 'prefix', 'A', 'B'])
            w.writeheader()
            w.writerows(items)
        with open(os.path.join(args.out_dir, 'items.jsonl'), 'w') as f:
            f.writelines(json.dumps(it) + '\n' for it in items)
        write_json(key, os.path.join(args.out_dir, 'key.json'))
        print(f"{len(items)} items ({args.checks} attention checks) -> {args.out_dir}/items.csv, items.jsonl; key.json is the key")
    else:
        at_least(args, 0, 'max_failed_checks')
        out = args.out or os.path.splitext(args.votes)[0] + '_report.json'
        check_writable(out, '--out', folder=False)
        key = read_json(args.key, "give the key.json that human_eval.py export wrote")
        if not isinstance(key, dict) or not {'systems', 'items'} <= set(key):
            raise ValueError(f"--key {args.key} is not a key.json of human_eval.py export (no systems/items)")
        if not os.path.isfile(args.votes):
            raise ValueError(f"--votes {args.votes} does not exist: give the raters' CSV (rater,item,choice)")
        with open(args.votes, newline='') as f:
            missing = {'rater', 'item', 'choice'} - set(next(csv.reader(f), []))
        if missing:
            raise ValueError(f"--votes {args.votes} lacks the column(s) {', '.join(sorted(missing))}: its header must be rater,item,choice")
        report = score(key, read_votes(args.votes, key), args.max_failed_checks)
        write_json(report, out)
        print(f"{report['system']} vs {report['versus']}: preferred {100 * report['preferred']:.1f}%, "
              f"not worse {100 * report['not_worse']:.1f}% of {report['votes']} votes "
              f"(one-sided binomial p = {report['p_value']:.3g}); dropped raters: {report['dropped_raters'] or 'none'}")


if __name__ == '__main__':
    run_main(main)
