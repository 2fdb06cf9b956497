#!/bin/sh
# Prints the results of compare.sh (its r/ folder, given as $1).
cd $1
for f in check-*.json; do python3 -c "
import json; d=json.load(open('$f')); print('$f', {k:v for k,v in d.items() if k not in ('cpu_tokens','gpu_tokens','dequantize_vs_cpu','dequantize_random_blocks_vs_cpu','max_abs_logit_diff_per_step','model','device','capability')})"; done
python3 -c "
import json
def t(f):
    try: return json.load(open(f))['token_ids']
    except Exception as e: return str(e)
full=t('sess-full-cpu.json'); g=t('sess-full-gpu.json'); a=t('sess-cpu-first.json'); b=t('sess-gpu-rest.json'); c=t('sess-gpu-first.json'); d=t('sess-cpu-rest.json')
print('gpu run == cpu run:', full==g, 'cpu->gpu session == uninterrupted:', a+b==full if isinstance(a,list) and isinstance(b,list) else (a,b), 'gpu->cpu:', c+d==full if isinstance(c,list) and isinstance(d,list) else (c,d))
"
tail -2 sess.err
python3 -c "
import json
a=json.load(open('sess-full-cpu.json'))['token_ids']
print('speculation on, gpu == cpu greedy:', json.load(open('run-gpu-spec.json'))['token_ids']==a)
" 2>&1 | tail -1
cat serve.json metrics.txt 2>/dev/null
cat ncu-smol.txt ncu-7b.txt 2>/dev/null | head -60
for f in bench-*.json batched-*.json; do python3 -c "
import json; print('$f', [(d['test'], round(d['tok_s_median'],1)) for d in json.load(open('$f'))])" 2>&1 | tail -1; done
python3 -c "
import json
for l in open('llama-bench.jsonl'):
    d=json.loads(l); print(d['model_filename'], 'fa', d['flash_attn'], d['n_prompt'], d['n_gen'], round(d['avg_ts'],1))
" 2>&1 | tail -12
grep -A6 "PP " llama-batched-*.txt 2>/dev/null | head -20
