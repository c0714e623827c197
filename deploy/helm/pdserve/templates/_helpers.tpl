{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's base name; the RayCluster is named this too (KubeRay's head Service is
     "<it>-head-svc"), so it stays short enough for KubeRay's derived names. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.routerSelectorLabels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.rayHead" -}}
{{- printf "%s-head-svc.%s.svc" (include "pdserve.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* A positive integer from values, or fail naming the key. */}}
{{- define "pdserve.positiveInt" -}}
{{- $v := index . 1 -}}
{{- $ok := or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- if $ok -}}{{- $ok = and (ge (int $v) 1) (eq (float64 (int $v)) (float64 $v)) -}}{{- end -}}
{{- if not $ok -}}
{{- fail (printf "%s must be an integer >= 1, got %v" (index . 0) $v) -}}
{{- end -}}
{{- int $v -}}
{{- end -}}

{{/* Pool sizes: everything below derives from .Values.prefill / .Values.decode. */}}
{{- define "pdserve.prefillPerPod" -}}
{{- include "pdserve.positiveInt" (list "prefill.workersPerPod" .Values.prefill.workersPerPod) -}}
{{- end -}}

{{- define "pdserve.prefillWorkers" -}}
{{- $r := include "pdserve.positiveInt" (list "prefill.replicas" .Values.prefill.replicas) | int -}}
{{- mul $r (include "pdserve.prefillPerPod" . | int) -}}
{{- end -}}

{{- define "pdserve.prefillGpusPerPod" -}}
{{- $g := .Values.prefill.gpusPerWorker | int -}}
{{- if lt $g 0 -}}{{- fail (printf "prefill.gpusPerWorker must be >= 0, got %v" .Values.prefill.gpusPerWorker) -}}{{- end -}}
{{- mul $g (include "pdserve.prefillPerPod" . | int) -}}
{{- end -}}

{{- define "pdserve.decodeTp" -}}
{{- include "pdserve.positiveInt" (list "decode.tp (tensor-parallel ranks per decode group)" .Values.decode.tp) -}}
{{- end -}}

{{- define "pdserve.decodePerPod" -}}
{{- include "pdserve.positiveInt" (list "decode.groupsPerPod" .Values.decode.groupsPerPod) -}}
{{- end -}}

{{- define "pdserve.decodeWorkers" -}}
{{- $r := include "pdserve.positiveInt" (list "decode.replicas" .Values.decode.replicas) | int -}}
{{- mul $r (include "pdserve.decodePerPod" . | int) -}}
{{- end -}}

{{- define "pdserve.decodeGpusPerPod" -}}
{{- mul (include "pdserve.decodeTp" . | int) (include "pdserve.decodePerPod" . | int) -}}
{{- end -}}

{{/* minReplicas <= replicas <= maxReplicas of a worker group; fails otherwise. */}}
{{- define "pdserve.checkBounds" -}}
{{- $name := index . 0 -}}{{- $g := index . 1 -}}
{{- if or (gt (int $g.minReplicas) (int $g.replicas)) (lt (int $g.maxReplicas) (int $g.replicas)) (lt (int $g.minReplicas) 0) -}}
{{- fail (printf "%s: need 0 <= minReplicas (%v) <= replicas (%v) <= maxReplicas (%v)" $name $g.minReplicas $g.replicas $g.maxReplicas) -}}
{{- end -}}
{{- end -}}

{{/* The `pdserve up --config` YAML: .Values.pdserve plus the keys the chart owns. */}}
{{- define "pdserve.settings" -}}
{{- $s := deepCopy (.Values.pdserve | default dict) -}}
{{- range $k := list "prefill_workers" "decode_workers" "decode_tp" "host" "port" "metrics_port" "http_port" "ray_address" "worker_host" "redis_url" "redis_password" -}}
{{- if hasKey $s $k -}}
{{- fail (printf "pdserve.%s is set by the chart: use prefill.*, decode.*, router.* or redis.* instead" $k) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $s "prefill_workers" (include "pdserve.prefillWorkers" . | int) -}}
{{- $_ := set $s "decode_workers" (include "pdserve.decodeWorkers" . | int) -}}
{{- $_ := set $s "decode_tp" (include "pdserve.decodeTp" . | int) -}}
{{- $_ := set $s "port" (.Values.router.grpcPort | int) -}}
{{- $_ := set $s "metrics_port" (.Values.router.metricsPort | int) -}}
{{- $_ := set $s "http_port" (.Values.router.httpPort | int) -}}
{{- toYaml $s -}}
{{- end -}}

{{/* Secrets: which Secret and key hold the Redis password / API token ("" if none). */}}
{{- define "pdserve.redisPasswordSecret" -}}
{{- if .Values.redis.existingSecret -}}{{- .Values.redis.existingSecret -}}
{{- else if or .Values.redis.password (not .Values.redis.external.url) -}}{{- include "pdserve.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisPasswordKey" -}}
{{- if .Values.redis.existingSecret -}}{{- .Values.redis.existingSecretKey -}}{{- else -}}redis-password{{- end -}}
{{- end -}}

{{- define "pdserve.apiTokenSecret" -}}
{{- if .Values.apiToken.existingSecret -}}{{- .Values.apiToken.existingSecret -}}
{{- else if .Values.apiToken.value -}}{{- include "pdserve.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.apiTokenKey" -}}
{{- if .Values.apiToken.existingSecret -}}{{- .Values.apiToken.existingSecretKey -}}{{- else -}}api-token{{- end -}}
{{- end -}}

{{/* Volumes every Ray container mounts: /tmp (Ray's session dir) and /dev/shm (object store). */}}
{{- define "pdserve.rayVolumes" -}}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- end -}}

{{- define "pdserve.rayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- end -}}
