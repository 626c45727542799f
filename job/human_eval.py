"""
The human-evaluation kit of the paper's Table 2 (Appendix A.4): raters see a prefix and two
continuations from two systems, in random order and without names, and pick the better one (or
'equal'). Attention checks pit a system against the real continuation; raters who prefer the
system there more often than allowed are dropped.

    python -m job.human_eval export --samples out/samples.json --systems joint,base --out_dir out/human_eval
        -> items.csv and items.jsonl for raters; key.json stays with you
    python -m job.human_eval score --key out/human_eval/key.json --votes votes.csv [--per_vote]
        votes.csv columns: rater,item,choice   (choice: A, B or equal)

Each item is decided by the majority of its raters' votes (the paper: 3 raters per item, "one
continuation better if it gets more votes"). Reports, for system 1 over system 2, over items: the
preference rate (strictly better) with the one-sided binomial p-value of items won against items
not won (equal items count as not won, as in the paper's Table 2), and the not-worse rate (better
or equal) with a one-sided sign test of items won against items lost (equal items set aside; see
score()). --per_vote counts votes instead; export refuses to replace an existing key.json unless
--force.
"""

import csv
import json
import math
import os
import random
import sys

if not __package__:  # run as a file: the repo root is not on the path
    sys.exit("error: run it as a module from the repo root: python -m job.human_eval")
from plumbing import ArgumentParser, check_writable, common_flags, not_a_file, run_main, write_json


def binomial_p_value(wins, losses):
    """P(X >= wins) for X ~ Binomial(wins + losses, 1/2): one-sided test of 'no preference'.
    score()'s p_value passes ties as losses (non-wins), as the paper's Table 2 does: its BASE LM
    vs BALM p = 0.88 is P(X >= 156) for X ~ Binomial(333, 1/2); its not_worse_p_value leaves
    ties out (a sign test)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def export(samples, systems, num_checks, seed):
    """Items (shuffled, A/B order random) and the key that unblinds them."""
    rng = random.Random(seed)
    s1, s2 = systems
    pairs = [(r['prefix'], (s1, r[s1]), (s2, r[s2]), False) for r in samples]
    if num_checks:
        if 'gold' not in samples[0]:
            raise ValueError("attention checks need real continuations: "
                             "sample data prefixes (--split), not --prompt")
        pairs += [(r['prefix'], (s1, r[s1]), ('gold', r['gold']), True)
                  for r in rng.sample(samples, min(num_checks, len(samples)))]
    rng.shuffle(pairs)
    items, key = [], {}
    for i, (prefix, x, y, check) in enumerate(pairs):
        a, b = (x, y) if rng.random() < 0.5 else (y, x)
        items.append(dict(item=i, prefix=prefix, A=a[1], B=b[1]))
        key[str(i)] = dict(A=a[0], B=b[0], check=check)
    return items, dict(systems=systems, items=key)


def score(key, votes, max_failed_checks=0, per_vote=False):
    """Preference of systems[0] (s1) over systems[1] (s2) from votes [(rater, item, choice)].

    Raters failing more than max_failed_checks attention checks are dropped: none of their votes
    count. Then, as in the paper (Appendix A.4, "we consider one continuation better if it gets
    more votes"; Table 2 counts sentences), each item is decided by its remaining votes: the item
    goes to the option among s1, s2 and 'equal' with strictly the most votes; with no strict
    plurality (s1 and s2 tied, or 'equal' tied with the leader) or an 'equal' plurality, the item
    is equal. Without 'equal' votes this is exactly the paper's rule. Items with no remaining
    vote are left out (counted in unvoted_items). Both one-sided tests are over items (votes on
    one item are not independent):
      p_value, for 'preferred': wins against non-wins, equal items counted as non-wins, as the
        paper's Table 2; null P(win) = 1/2 (conservative for no preference: P(win) = (1 - t) / 2
        then, t the tie rate).
      not_worse_p_value, for 'not_worse': a sign test, P(X >= wins) for X ~ Binomial(wins +
        losses, 1/2), equal items set aside. Null: no preference, P(win) = P(loss), ties at any
        rate. The not-worse share itself has no fixed null value: with no preference and tie rate
        t it is (1 + t) / 2, t unknown, so testing it against 1/2 would find a preference in ties
        alone. Given the number of non-tied items, wins are Binomial(., 1/2) under the null
        whatever t is, and a large win count means a not-worse share above (1 + t) / 2.

    per_vote: every counted vote is a unit instead (wins, losses, ties and both tests over votes);
    their p-values are too small, since raters of one item agree more often than independent votes
    would. The report's 'unit' says which ('item' or 'vote')."""
    s1, s2 = key['systems']
    failed, seen = {}, set()
    for rater, item, choice in votes:
        if (rater, item) in seen:  # one rater must not weigh twice in an item's majority
            raise ValueError(f"rater {rater} voted more than once on item {item}: "
                             "keep one vote per rater and item")
        seen.add((rater, item))
        k = key['items'][item]
        if k['check'] and choice in ('A', 'B') and k[choice] != 'gold':
            failed[rater] = failed.get(rater, 0) + 1
    dropped = sorted(r for r, n in failed.items() if n > max_failed_checks)
    tally = {}  # item -> {s1: n, s2: n, 'equal': n}
    for rater, item, choice in votes:
        k = key['items'][item]
        if k['check'] or rater in dropped:
            continue
        t = tally.setdefault(item, {s1: 0, s2: 0, 'equal': 0})
        t['equal' if choice == 'equal' else k[choice]] += 1
    num_votes = sum(sum(t.values()) for t in tally.values())
    if per_vote:
        wins, losses, ties = (sum(t[c] for t in tally.values()) for c in (s1, s2, 'equal'))
    else:
        outcome = [plurality(t) for t in tally.values()]
        wins, losses, ties = (outcome.count(c) for c in (s1, s2, 'equal'))
    n = wins + losses + ties
    unvoted = sum(1 for i, k in key['items'].items() if not k['check'] and i not in tally)
    return dict(system=s1, versus=s2, unit='vote' if per_vote else 'item', n=n, votes=num_votes,
                wins=wins, losses=losses, ties=ties, unvoted_items=unvoted, dropped_raters=dropped,
                preferred=wins / n if n else float('nan'), not_worse=(wins + ties) / n if n else float('nan'),
                p_value=binomial_p_value(wins, losses + ties),
                not_worse_p_value=binomial_p_value(wins, losses))


def plurality(tally):
    """The option with strictly the most votes, else 'equal'."""
    (a, na), (_, nb) = sorted(tally.items(), key=lambda kv: -kv[1])[:2]
    return a if na > nb else 'equal'


# -----------------------------------------------------------------------------
# files: one clear error for a missing or malformed one

def load_json(path, flag, hint):
    if not_a_file(path):
        raise ValueError(f"{flag} {path} {not_a_file(path)}: {hint}")
    try:
        with open(path) as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path} is not valid JSON ({e}): {hint}") from None


def check_key(key, path):
    ok = (isinstance(key, dict) and isinstance(key.get('systems'), list) and len(key['systems']) == 2
          and isinstance(key.get('items'), dict)
          and all(isinstance(k, dict) and {'A', 'B', 'check'} <= set(k) for k in key['items'].values()))
    if not ok:
        raise ValueError(f"--key {path} is not a key written by human_eval.py export "
                         "(systems, items with A/B/check)")
    return key


def read_votes(path, key):
    if not_a_file(path):
        raise ValueError(f"--votes {path} {not_a_file(path)}: give the CSV of votes "
                         "(columns rater,item,choice)")
    try:
        with open(path, newline='', encoding='utf-8-sig') as f:  # -sig: a spreadsheet's BOM is not a column
            reader = csv.DictReader(f)
            if not {'rater', 'item', 'choice'} <= set(reader.fieldnames or ()):
                raise ValueError(f"--votes {path} needs a header with columns rater,item,choice "
                                 f"(has {reader.fieldnames})")
            votes = [(r['rater'], r['item'], (r['choice'] or '').strip()) for r in reader]
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"--votes {path} is not a readable CSV ({e}): columns rater,item,choice") from None
    for rater, item, choice in votes:
        if rater is None or item not in key['items'] or choice not in ('A', 'B', 'equal'):
            shown = ', '.join(str(v) if v is None or v.isprintable() else repr(v)  # a NUL escaped, not echoed
                              for v in (rater, item, choice))
            raise ValueError(f"bad vote ({shown}) in {path}: "
                             "item must be in the key and choice A, B or equal")
    return votes


def write_items(items, out_dir):
    """items.csv and items.jsonl, each written atomically."""
    csv_path, jsonl_path = os.path.join(out_dir, 'items.csv'), os.path.join(out_dir, 'items.jsonl')
    with open(csv_path + '.tmp', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=['item', 'prefix', 'A', 'B'])
        w.writeheader()
        w.writerows(items)
    with open(jsonl_path + '.tmp', 'w') as f:
        f.writelines(json.dumps(it) + '\n' for it in items)
    os.replace(csv_path + '.tmp', csv_path)
    os.replace(jsonl_path + '.tmp', jsonl_path)


def main(argv=None):
    p = ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest='cmd', required=True)
    e = sub.add_parser('export', help='write items for raters and the key')
    e.add_argument('--samples', default='out/samples.json', path=True, help="sample.py's JSON output")
    e.add_argument('--systems', default='joint,base',
                   help='the two systems compared (base, joint, worst, gold)')
    e.add_argument('--checks', type=int, default=2, at_least=0, at_most='count',
                   help='attention-check items (system vs real text)')
    common_flags(e, 'out_dir', 'force', 'seed', default=dict(out_dir='out/human_eval'), help=dict(
        force='overwrite an existing key.json (votes collected against it become unscorable)'))
    s = sub.add_parser('score', help='read votes back and report the preference')
    s.add_argument('--key', default='out/human_eval/key.json', path=True, help="export's key.json")
    s.add_argument('--votes', required=True, path=True, help='CSV with columns rater,item,choice')
    s.add_argument('--max_failed_checks', type=int, default=0, at_least=0, at_most='count',
                   help='drop raters failing more checks than this')
    s.add_argument('--per_vote', action='store_true',
                   help='count votes, not items decided by majority (p-values too small)')
    s.add_argument('--out', default=None, help='JSON report (default: beside the votes)')
    args = p.parse_args(argv)
    if args.cmd == 'export':
        run_export(args)
    else:
        run_score(args)


def run_export(args):
    """human_eval.py export: blinded items of the two systems and attention checks, and the key."""
    key_path = os.path.join(args.out_dir, 'key.json')
    # a new key would silently rescore votes collected on the old items
    if os.path.exists(key_path) and not args.force:
        raise ValueError(f"{key_path} exists: "
                         "votes collected against it would score wrongly with a new key; "
                         f"choose another --out_dir, or pass --force to overwrite it")
    check_writable(args.out_dir, '--out_dir')
    hint = "give sample.py's JSON output (python sample.py ... --out FILE)"
    samples = load_json(args.samples, '--samples', hint)
    if (not isinstance(samples, dict) or not isinstance(samples.get('samples'), list)
            or not samples['samples']):
        raise ValueError(f"--samples {args.samples} has no 'samples' list: {hint}")
    samples = samples['samples']
    systems = args.systems.split(',')
    if len(systems) != 2 or systems[0] == systems[1] or any(sys_ not in samples[0] for sys_ in systems):
        raise ValueError(f"--systems must name two different ones of "
                         f"{[k for k in ('base', 'joint', 'worst', 'gold') if k in samples[0]]}")
    if args.checks > len(samples):  # one check per sample at most: a check reuses a sample's prefix
        raise ValueError(f"--checks {args.checks}: at most the number of samples ({len(samples)})")
    items, key = export(samples, systems, args.checks, args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    write_items(items, args.out_dir)
    write_json(key, key_path)
    print(f"{len(items)} items ({args.checks} attention checks) -> {args.out_dir}/items.csv, "
          "items.jsonl; key.json is the key")


def run_score(args):
    """human_eval.py score: the votes against the key, each item decided by its raters' majority."""
    out = args.out or os.path.splitext(args.votes)[0] + '_report.json'
    check_writable(out, '--out', folder=False)
    key = check_key(load_json(args.key, '--key', 'give the key.json that human_eval.py export wrote'),
                    args.key)
    report = score(key, read_votes(args.votes, key), args.max_failed_checks, args.per_vote)
    if report['n'] == 0:
        raise ValueError(f"--votes {args.votes} holds no vote on a scored item (only a header, attention "
                         f"checks, or dropped raters): nothing to report")
    write_json(report, out)
    unit = (f"{report['n']} items (each decided by the majority of its raters; {report['votes']} votes)"
            if report['unit'] == 'item'
            else f"{report['n']} votes (per vote: votes on one item are not independent)")
    print(f"{report['system']} vs {report['versus']}, of {unit}:\n"
          f"  preferred {100 * report['preferred']:.1f}%, one-sided binomial p = {report['p_value']:.3g} "
          f"(won vs not won over {report['unit']}s)\n"
          f"  not worse {100 * report['not_worse']:.1f}%, one-sided sign test p = "
          f"{report['not_worse_p_value']:.3g} (won vs lost, equal {report['unit']}s set aside)\n"
          f"  dropped raters: {report['dropped_raters'] or 'none'}")


if __name__ == '__main__':
    run_main(main)
