{{/* Names: <release>-gapserve, shortened to the 63 characters a DNS label allows. */}}
{{- define "gapserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gapserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: include "gapserve.selector" (list . "worker") */}}
{{- define "gapserve.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ $.Chart.Name }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "gapserve.tokenSecret" -}}
{{- .Values.internalToken.existingSecret | default (printf "%s-internal-token" (include "gapserve.fullname" .)) -}}
{{- end -}}

{{/* Data parallelism (dataParallelSize > 1): replica i's scheduler and workers are
     named <fullname>-r<i>-... and labelled gapserve.io/replica; with one replica the
     names are the single engine's. scheduler.yaml and worker.yaml render once per
     replica with the root's fields plus `replica` (its index) as the context. */}}
{{- define "gapserve.replicaName" -}}
{{- if gt (int .Values.dataParallelSize) 1 -}}
{{- printf "%s-r%d" (include "gapserve.fullname" .) (int .replica) -}}
{{- else -}}
{{- include "gapserve.fullname" . -}}
{{- end -}}
{{- end -}}

{{/* selector of one component of this replica: include "gapserve.replicaSelector" (list . "worker") */}}
{{- define "gapserve.replicaSelector" -}}
{{- $ := index . 0 -}}
{{ include "gapserve.selector" . }}
{{- if gt (int $.Values.dataParallelSize) 1 }}
gapserve.io/replica: {{ $.replica | quote }}
{{- end }}
{{- end -}}

{{/* replica i's scheduler address as the frontend dials it: include "gapserve.schedulerAddress" (list . i) */}}
{{- define "gapserve.schedulerHost" -}}
{{- $ := index . 0 -}}
{{- $name := ternary (printf "%s-r%d" (include "gapserve.fullname" $) (int (index . 1))) (include "gapserve.fullname" $) (gt (int $.Values.dataParallelSize) 1) -}}
{{- printf "%s-scheduler.%s.svc" $name $.Release.Namespace -}}
{{- end -}}

{{/* KV events of every replica's scheduler (for the frontend's kv-aware routing) */}}
{{- define "gapserve.kvEventsOn" -}}
{{- if and (gt (int .Values.dataParallelSize) 1) (eq .Values.dataParallelRouting "kv-aware") (not .Values.router.enabled) -}}true{{- end -}}
{{- end -}}

{{/* the workers' own headless Service (StatefulSet pods, metrics) */}}
{{- define "gapserve.workersService" -}}
{{- printf "%s-workers" (include "gapserve.replicaName" .) -}}
{{- end -}}

{{/* scheduler -> worker: one host:port per rank, in rank order */}}
{{- define "gapserve.workerAddresses" -}}
{{- $full := include "gapserve.replicaName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $port := int .Values.worker.port -}}
{{- $out := list -}}
{{- range $rank := until (int .Values.tensorParallel.size) -}}
{{- if $.Values.tensorParallel.multiNode -}}
{{- /* LWS pods: <lws>-<group> is the leader, <lws>-<group>-<index> the others,
       all under the headless Service named after the LWS */ -}}
{{- $pod := ternary (printf "%s-worker-0" $full) (printf "%s-worker-0-%d" $full $rank) (eq $rank 0) -}}
{{- $out = append $out (printf "%s.%s-worker.%s.svc:%d" $pod $full $ns $port) -}}
{{- else -}}
{{- $out = append $out (printf "%s-worker-%d.%s.%s.svc:%d" $full $rank (include "gapserve.workersService" $) $ns $port) -}}
{{- end -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "gapserve.image" -}}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | toString) | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{/* The environment every gapserve container shares: bind the pod's address, log
     JSON lines, the pinned hash seed, traces, the internal token from its Secret and
     the TLS files from theirs. */}}
{{- define "gapserve.commonEnv" -}}
- name: GAPSERVE_HOST
  value: "0.0.0.0"
- name: GAPSERVE_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "gapserve.tokenSecret" . }}
      key: {{ .Values.internalToken.key }}
- name: GAPSERVE_LOG_FORMAT
  value: json
- name: GAPSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: GAPSERVE_DRAIN_TIMEOUT_S
  value: {{ .Values.drainTimeoutS | quote }}
- name: PYTHONHASHSEED
  value: {{ .Values.pythonHashSeed | quote }}
{{- with .Values.observability.otlpTracesEndpoint }}
- name: GAPSERVE_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: GAPSERVE_TLS_CERT
  value: /etc/gapserve/tls/tls.crt
- name: GAPSERVE_TLS_KEY
  value: /etc/gapserve/tls/tls.key
{{- if .Values.tls.mutual }}
- name: GAPSERVE_TLS_CA
  value: /etc/gapserve/tls/ca.crt
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gapserve.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/gapserve/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "gapserve.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}  {{- /* templates/validate.yaml requires it */}}
{{- end }}
{{- end -}}

{{/* prometheus.io annotations on a pod template: include "gapserve.scrape" (list . port) */}}
{{- define "gapserve.scrape" -}}
{{- $ := index . 0 -}}
{{- if $.Values.observability.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* the image runs as uid 10001 (Dockerfile) */}}
{{- define "gapserve.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  fsGroup: 10001
{{- end -}}

{{- define "gapserve.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: [ALL]
{{- end -}}

{{/* gRPC health is plaintext only (a kubelet grpc probe cannot speak TLS): under
     TLS the inner services are probed with a TCP connect instead. */}}
{{- define "gapserve.grpcProbe" -}}
{{- $ := index . 0 -}}
{{- if $.Values.tls.enabled }}
tcpSocket:
  port: {{ index . 1 }}
{{- else }}
grpc:
  port: {{ index . 1 }}
{{- end }}
{{- end -}}

{{/* --model: the worker loads it, the frontend reads its tokenizer and name */}}
{{- define "gapserve.modelEnv" -}}
{{- with .Values.model }}
- name: GAPSERVE_MODEL
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* the limits the worker and the scheduler share (0: the service's default) */}}
{{- define "gapserve.limitsEnv" -}}
{{- range $key, $flag := dict "maxModelLen" "MAX_MODEL_LEN" "maxNumSeqs" "MAX_NUM_SEQS" "maxNumBatchedTokens" "MAX_NUM_BATCHED_TOKENS" }}
{{- with (index $.Values.limits $key) }}
- name: GAPSERVE_{{ $flag }}
  value: {{ . | int64 | quote }}
{{- end }}
{{- end }}
{{- end -}}
